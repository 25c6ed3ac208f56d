"""captioner.training"""
