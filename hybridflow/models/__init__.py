"""hybridflow.models"""
