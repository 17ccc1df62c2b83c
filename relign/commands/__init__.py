"""Commands beside the recipes: ``presets``, ``plan``, ``version``, ``chat``, ``generate``, ``merge-lora``.

Each module exposes ``main(argv) -> int``. The CLI imports a module only when its command
runs, so ``relign --version`` or ``relign presets`` never pays for torch.
"""

from __future__ import annotations

# name -> (module, arguments, one-line summary), in the order ``relign --help`` lists them.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "presets": ("relign.commands.presets", "[NAME]", "List the shipped presets (NAME: print that preset's YAML)."),
    "plan": ("relign.commands.plan", "RECIPE CONFIG [k=v ...] [--device NAME] [--world N]",
             "Memory per rank and stage, the largest micro-batch that fits, a step time: before anything loads."),
    "chat": ("relign.commands.chat", "MODEL", "Talk to a model in the terminal, with its chat template."),
    "generate": ("relign.commands.generate", "MODEL PROMPTS.jsonl", "Batch generation: one JSONL row per completion."),
    "lc-data": ("relign.commands.lc_data", "MODEL LC_ROWS", "Linguistic calibration: summary-distillation SFT rows."),
    "merge-lora": ("relign.commands.merge_lora", "RUN_OR_ADAPTER OUT", "Merge a LoRA adapter into its base: a plain HF model."),
    "version": ("relign.commands.version", "", "Print the versions of relign, torch and transformers (also --version)."),
}
