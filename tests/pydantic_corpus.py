"""Pydantic models as application code writes them, for structured output.

`MODELS`: each model's `model_json_schema()` must be served, and JSON generated under its
grammar must pass the model's own `model_validate_json`. Strings are mostly unbounded, as
in real code; bounds, optionals, enums, nested models, lists, sets, tuples, dicts, dates,
UUIDs, e-mail addresses, URLs, IP addresses, unions and discriminated unions all appear.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from ipaddress import IPv4Address, IPv6Address
from typing import Annotated, Literal

from pydantic import (
    UUID4,
    AnyUrl,
    BaseModel,
    ConfigDict,
    EmailStr,
    Field,
    HttpUrl,
    IPvAnyAddress,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    conint,
    constr,
)


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Priority(enum.IntEnum):
    LOW = 1
    MEDIUM = 2
    HIGH = 3


class Item(BaseModel):
    sku: str = Field(max_length=12)
    quantity: int = Field(ge=1)
    unit_price: float = Field(gt=0)


class Order(BaseModel):
    id: int = Field(ge=0)
    items: list[Item] = Field(min_length=1, max_length=3)
    discount: float = Field(ge=0, le=1, default=0)
    placed: dt.date
    note: str | None = None


class Reading(BaseModel):
    celsius: float = Field(ge=-273.15, le=1000)
    humidity: float = Field(ge=0, lt=100)
    wind: NonNegativeFloat
    at: dt.datetime


class Score(BaseModel):
    value: float = Field(gt=-1, lt=1)
    rank: int = Field(gt=0, le=10)
    delta: int = Field(ge=-100, lt=100)
    tries: NonNegativeInt
    step: Annotated[int, Field(multiple_of=5, ge=0, le=100)]


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    age: PositiveInt
    email: EmailStr
    favourite: Color
    nickname: str | None = None


class Ticket(BaseModel):
    id: UUID4
    trace: uuid.UUID
    priority: Priority
    opened: dt.datetime
    due: dt.date | None
    window: dt.time


class Address(BaseModel):
    street: str
    city: str
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class Company(BaseModel):
    name: str
    address: Address
    branches: list[Address] = Field(max_length=2)


class Cat(BaseModel):
    pet_type: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: bool


class Fish(BaseModel):
    pet_type: Literal["fish"]
    depth: PositiveFloat


class Owner(BaseModel):
    pet: Cat | Dog | Fish = Field(discriminator="pet_type")


class Shelter(BaseModel):
    pets: list[Annotated[Cat | Dog, Field(discriminator="pet_type")]] = Field(max_length=3)


class Measurement(BaseModel):
    value: int | float | str
    unit: Literal["m", "s", "kg"] | None


class Inventory(BaseModel):
    counts: dict[str, NonNegativeInt]
    tags: set[Literal["new", "sale", "clearance"]]
    colors: frozenset[Color]
    flags: set[bool]


class Point(BaseModel):
    xy: tuple[int, int]
    label: tuple[str, float, bool]


class Node(BaseModel):
    value: int
    children: list[Node] = Field(default_factory=list, max_length=2)


class Link(BaseModel):
    url: HttpUrl
    mirror: AnyUrl | None = None


class Host(BaseModel):
    v4: IPv4Address
    v6: IPv6Address
    any: IPvAnyAddress


class Task(BaseModel):
    title: constr(max_length=30)
    estimate: dt.timedelta
    done: bool = False
    level: conint(ge=1, le=5) = 3


class Secret(BaseModel):
    user: str
    password: SecretStr
    blob: bytes


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["strict"]
    ratio: float = Field(ge=0.1, le=0.9)
    level: Literal[1, 2, 3]


class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=3)
    weights: list[Annotated[float, Field(ge=0, le=1)]] = Field(min_length=2, max_length=4)


class Event(BaseModel):
    name: str
    starts: dt.datetime
    ends: dt.datetime | None = None
    attendees: list[EmailStr] = Field(max_length=3)
    priority: Priority = Priority.MEDIUM


class Survey(BaseModel):
    answers: dict[str, Literal["yes", "no"]]
    rating: Annotated[int, Field(ge=1, le=5)]
    comment: Annotated[str, Field(max_length=40)] | None


class Negative(BaseModel):
    debt: float = Field(lt=0)
    floor: int = Field(le=-1)
    offset: float = Field(ge=-0.5, le=0.5)


MODELS: dict[str, type[BaseModel]] = {
    model.__name__: model
    for model in (
        Order,
        Reading,
        Score,
        Person,
        Ticket,
        Company,
        Owner,
        Shelter,
        Measurement,
        Inventory,
        Point,
        Node,
        Link,
        Host,
        Task,
        Secret,
        Strict,
        Matrix,
        Event,
        Survey,
        Negative,
    )
}
