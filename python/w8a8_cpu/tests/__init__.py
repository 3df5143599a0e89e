"""Small test subset installed with the package (conda recipe tests, cibuildwheel test-command):

    python -m pytest -q --pyargs w8a8_cpu.tests
"""
