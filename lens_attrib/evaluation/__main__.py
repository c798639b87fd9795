"""``python -m lens_attrib.evaluation``: the evaluation command line (:mod:`.cli`)."""

from lens_attrib.evaluation.cli import main

if __name__ == "__main__":
    main()
