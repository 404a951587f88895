"""hybridflow.pipeline"""
