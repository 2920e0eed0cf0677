"""``sdlite samplers``: the samplers, their default schedules and their A1111 names."""
from __future__ import annotations


def cmd_samplers(args) -> int:
    from ..sampling.samplers import A1111_NAMES, SAMPLERS

    by_sampler: dict[str, list[str]] = {}
    for alias, name in A1111_NAMES.items():
        by_sampler.setdefault(name, []).append(alias)
    print(f"{'name':<14}{'default schedule':<18}{'A1111 names':<28}reference")
    for name, info in SAMPLERS.items():
        aliases = ", ".join(by_sampler.get(name, []))
        print(f"{name:<14}{info.schedule:<18}{aliases:<28}{info.reference}")
    print("\nschedules: discrete, karras, exponential (--schedule, or a ' Karras'/' Exponential' suffix "
          "on an A1111 name: \"DPM++ 2M Karras\")")
    for kind in ("timesteps", "sigmas"):
        takers = ", ".join(name for name, info in SAMPLERS.items() if kind in info.custom)
        print(f"explicit --{kind} (as diffusers' {kind}=): {takers}")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("samplers", help="list the samplers, their default schedules and A1111 names")
    s.set_defaults(func=cmd_samplers)
