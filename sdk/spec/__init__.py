"""JobSpec: the declarative job description (pydantic), its rules and file I/O."""
