"""hybridflow.stages"""
