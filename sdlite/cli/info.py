"""``sdlite info``: describe a checkpoint (family, layout, dtype, parameters, anything unusual), or with
``--system`` this machine and the engine's choices on it."""
from __future__ import annotations

from .options import TURBO_DEFAULTS_TEXT, resolve_model



def cmd_info(args) -> int:
    from ..families import family_for
    from ..families.describe import describe_component, describe_schedule, family_name
    from ..loader import open_model, resolve_prediction_type

    if getattr(args, "system", False):
        from ..engine.cpu import system_report
        from ..engine.precision import precision_report

        print("\n".join(system_report() + precision_report()))
        if args.path is None:
            return 0
        print()
    with open_model(resolve_model(args.path), prediction_type=args.prediction_type,
                    text_encoders=args.text_encoder or ()) as ckpt:
        if ckpt.prediction_source == "unresolved":
            resolve_prediction_type(ckpt)
        spec = ckpt.spec
        layout = "diffusers folder" if ckpt.layout == "diffusers" else \
            f"original single file ({ckpt._stores[0].container})" + \
            (f" with {len(ckpt._stores) - 1} text-encoder file(s)" if len(ckpt._stores) > 1 else "")
        print(f"path:        {ckpt.path}")
        print(f"layout:      {layout}")
        print(f"family:      {spec.family} ({family_name(spec)})")
        print(f"prediction:  {spec.prediction_type} ({ckpt.prediction_source})")
        print(f"storage:     {str(ckpt.storage_dtype).replace('torch.', '')}")
        print(f"image size:  {spec.default_size}x{spec.default_size} (native)")
        if ckpt.tiny_vae is not None:
            print("vae decoder: the AutoencoderTiny (TAESD) in vae/, by default; "
                  + ("--vae-decoder vae: the AutoencoderKL in vae_large/" if ckpt.has_vae else "no full VAE"))
        for line in family_for(spec).info_lines():
            print(line)
        if spec.turbo:
            print(f"turbo:       defaults {TURBO_DEFAULTS_TEXT}")
        print(f"schedule:    {describe_schedule(ckpt.scheduler_config)}")
        print(f"             from {ckpt.scheduler_source}")
        counts = ckpt.parameter_counts()
        print("components:")
        for name in ckpt.components:
            if name in counts:
                print(f"  {name:<15}{counts[name]:>14,} params  {describe_component(name, spec)}")
        print(f"  {'total':<15}{sum(counts.values()):>14,} params")
        unusual = ckpt.problems() + ckpt.notes
        if ckpt.detection.has_ema:
            unusual.append("the file carries EMA copies of the UNet weights (model_ema.*); the non-EMA ones are used")
        ignored = sum(len(s.ignored) for s in ckpt.sources.values())
        if ignored:
            from ..config import is_bert

            pooler = is_bert(spec.text) and any(k.startswith(("pooler.", "bert.pooler.", "cls."))
                                                for k in ckpt.sources["text_encoder"].ignored)
            unusual.append(f"{ignored} {'tensors' if pooler else 'buffers'} ignored (e.g. position_ids, schedule tensors"
                           + (", BERT's pooler, which Stable Diffusion does not use)" if pooler else ")"))
        print("unusual:" if unusual else "unusual:     nothing")
        for line in unusual:
            print(f"  - {line}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="describe a checkpoint (family, layout, dtype, parameters, anything unusual)")
    p.add_argument("path", nargs="?", default=None,
                   help="a diffusers folder or a .safetensors/.ckpt single file (default: the shipped demo model)")
    p.add_argument("--prediction-type", choices=["epsilon", "v_prediction"], default=None,
                   help="override what the checkpoint says (SD 2.x single files)")
    p.add_argument("--text-encoder", action="append", metavar="PATH", default=None,
                   help="a part a single-file SD3, FLUX, Z-Image, FLUX.2 klein or Qwen-Image model lacks "
                        "(repeatable; see `sdlite generate --help`)")
    p.add_argument("--system", action="store_true",
                   help="describe this machine instead (CPU, ISA flags and caps, torch, and the engine's choices: "
                        "prepacking, int8 activation range, quantize modes); with a PATH, the checkpoint too")
    p.set_defaults(func=cmd_info)
