"""Drop-in adapters for the trainers people already run. Each module imports nothing of
its trainer: it reproduces the trainer's call signature and computes through lossagg."""
