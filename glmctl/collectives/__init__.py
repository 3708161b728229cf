"""glmctl.collectives"""
