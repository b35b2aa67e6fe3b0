"""No Python op classes for the stablehlo dialect (see __init__)."""
