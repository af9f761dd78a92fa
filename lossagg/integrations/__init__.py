"""Drop-in adapters for the trainers people already run. ``verl`` and ``megatron`` import
nothing of their trainer (they reproduce its call signature and compute through lossagg);
``trl`` subclasses TRL's ``GRPOTrainer`` and so imports TRL; ``miles`` plugs into miles' own hooks
and imports miles only inside them (at run time, in miles' processes)."""
