"""The lazy graph: hash-consed classes, matching, extraction, fusion and scheduling."""
