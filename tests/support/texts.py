"""Texts the sparse and multi-vector tests share: Korean, English, Japanese, emoji and one long
enough to be truncated at the zoo models' 64 tokens."""

SCRIPTS = [
    "서울의 날씨는 어떤가요?",
    "A man is eating a piece of bread.",
    "東京の天気はどうですか",
    "🌧️ rain 비",
    "Kubernetes readiness gates keep a pod out of the endpoints until it is warm. " * 4,
]
