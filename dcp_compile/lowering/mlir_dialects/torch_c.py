"""No Python op classes for the torch_c dialect (see __init__)."""
