"""The structure the source and the tests promise."""
