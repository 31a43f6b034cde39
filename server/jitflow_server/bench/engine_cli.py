"""placeholder"""
def register(bench_app):
    pass
