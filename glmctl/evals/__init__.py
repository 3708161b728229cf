"""glmctl.evals"""
