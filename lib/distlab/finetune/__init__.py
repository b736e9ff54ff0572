"""Fine-tuning: LoRA adapters (lora.py), and starting from a trained model on a new task with
replay and EWC against forgetting the old one (forgetting.py).

May import: the foundation, data/, models/, parallel/ and config. The rank's loop imports it,
never the reverse.
"""
