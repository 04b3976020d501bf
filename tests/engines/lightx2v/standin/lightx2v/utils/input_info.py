"""Stand-in for ``lightx2v.utils.input_info``: ``set_input_info(args)`` builds the
per-request input info from the request's fields by ``args.task`` (attribute
access, as LightX2V's server passes an ``EasyDict`` of the task data)."""

from dataclasses import dataclass, field


@dataclass
class T2VInputInfo:
    seed: int = 0
    prompt: str = ""
    negative_prompt: str = ""
    save_result_path: str = ""
    return_result_tensor: bool = False
    latent_shape: list = field(default_factory=list)


@dataclass
class I2VInputInfo(T2VInputInfo):
    image_path: str = ""


def set_input_info(args):
    common = {
        "seed": args.seed,
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "save_result_path": args.save_result_path,
        "return_result_tensor": args.return_result_tensor,
    }
    if args.task == "t2v":
        return T2VInputInfo(**common)
    if args.task == "i2v":
        return I2VInputInfo(image_path=args.image_path, **common)
    raise NotImplementedError(f"the stand-in has no input info for task {args.task!r}")
