pytest_plugins = ["warmgate_devcluster.pytest_plugin"]
