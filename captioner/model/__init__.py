"""captioner.model"""
