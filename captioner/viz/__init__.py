"""captioner.viz"""
