"""`python -m tallow`: a short demonstration of the core until the server lands."""
from tallow.demo import main

if __name__ == "__main__":
    main()
