"""captioner.evaluation"""
