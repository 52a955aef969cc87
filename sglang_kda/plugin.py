"""SGLang general-plugin entry point (group ``sglang.srt.plugins``)."""


def load() -> None:
    from sglang_kda.patches import apply_all

    apply_all()
