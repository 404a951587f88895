"""hybridflow.transport"""
