"""Stand-in for ``lightx2v.utils.set_config.set_config``: defaults, then the JSON
of ``--config_json`` merged on top (unknown keys survive, as in
``auto_calc_config``)."""

import json


def set_config(args) -> dict:
    config = {
        "model_cls": args.model_cls,
        "task": args.task,
        "text_len": 512,
        "enable_cfg": False,
        "use_image_encoder": True,
    }
    if args.config_json:
        with open(args.config_json) as f:
            config.update(json.load(f))
    return config
