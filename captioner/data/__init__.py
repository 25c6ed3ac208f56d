"""captioner.data"""
