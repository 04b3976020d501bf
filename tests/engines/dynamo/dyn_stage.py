"""A Dynamo omni stage worker with the model engine stubbed: ``python dyn_stage.py ARGS``.

ARGS are ``python -m dynamo.vllm.omni``'s (``--stage-id N --model ... --stage-configs-path
...``). Only ``dynamo.vllm.omni.stage_worker._create_engine`` (which builds vLLM-Omni's
``AsyncOmni`` for the stage) is replaced, by ``dyn_stub.create_engine``; argument
parsing, the runtime, ``init_omni_stage``, ``OmniStageWorker`` and the connectors
are Dynamo's and vLLM-Omni's. The connector registers itself (this script does not).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dyn_stub


def main() -> None:
    from dynamo.vllm.omni import stage_worker

    stage_worker._create_engine = dyn_stub.create_engine
    from dynamo.vllm.omni.main import main as dynamo_main

    dynamo_main()


if __name__ == "__main__":
    main()
