"""The class run: the parent process of a class (``cli.grade``). It prepares each repository's folder,
starts one ``repo.repo_job`` process (or submitit job) per repository with its time limit, turns each
end into an outcome, and writes the class report once every repository ended."""
