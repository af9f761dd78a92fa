"""Drop-in adapters for the trainers people already run. ``verl`` and ``megatron`` import
nothing of their trainer (they reproduce its call signature and compute through lossagg);
``trl`` subclasses TRL's ``GRPOTrainer`` and so imports TRL."""
