"""Stand-in for ``lightx2v.infer.init_runner``: ``RUNNER_REGISTER[model_cls](config)``
then ``runner.init_modules()`` (which calls ``init_disagg``)."""

from lightx2v.models.runners.wan.wan_runner import WanRunner

RUNNER_REGISTER = {"wan2.1": WanRunner}


def init_runner(config):
    runner = RUNNER_REGISTER[config["model_cls"]](config)
    runner.init_modules()
    return runner
