def pytest_configure(config):
    # DCP's single-process notice; yatt.ckpt silences it outside pytest, which resets filters.
    config.addinivalue_line(
        "filterwarnings", "ignore:torch.distributed is disabled, unavailable or uninitialized"
    )
