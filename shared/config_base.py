"""What every config section is (a pydantic model that refuses unknown keys and checks assignments), and
the one constant the sections share."""

from pydantic import BaseModel, ConfigDict

# The environment variable that carries the bearer token (both processes), unless server.api_token_env
# names another.
TOKEN_ENV = "TANDEM_API_TOKEN"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
