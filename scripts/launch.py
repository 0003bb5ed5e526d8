"""The checked front door: deepspeed's arguments, hostfile and config checked, then deepspeed run with them."""

from fathom.pipeline.launch.command import main

if __name__ == "__main__":
    main()
