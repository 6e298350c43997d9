"""GBNF for the string `format`s pydantic writes, each a narrowing of its standard that
pydantic's own validators accept.

`FORMATS`: format → (GBNF for the string's characters, without quotes; shortest and longest
length). Dates know month lengths (February stops at 28) and years run 1000-9999; `uuidN`
fixes the version and variant nibbles (pydantic's `UUID4` checks them); `email`, `uri`,
`ipv6` and `duration` are common forms of their standards, not all of them. `ANY_STRING`:
formats whose pydantic type accepts every string (`SecretStr`, `bytes`, `Path`).
"""

from __future__ import annotations

ANY_STRING = frozenset({"password", "binary", "path"})

_HEX = "[0-9a-fA-F]"
_DATE = (
    '[1-9] [0-9]{3} "-" ("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
    ' | [1-9] [0-9]{3} "-" ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30")'
    ' | [1-9] [0-9]{3} "-02-" ("0" [1-9] | "1" [0-9] | "2" [0-8])'
)
_TIME = (
    '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})?'
    ' ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])'
)
_LABEL = "[a-z0-9] ([a-z0-9-]{0,18} [a-z0-9])?"
_DOMAIN = f'{_LABEL} ("." {_LABEL})? "." ("com" | "org" | "net" | "io" | "dev")'
_ATOM = "[a-zA-Z0-9_+-]{1,16}"
_OCTET = '"25" [0-5] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9] [0-9] | [0-9]'
_IPV4 = f'({_OCTET}) ("." ({_OCTET})){{3}}'
_IPV6 = f'{_HEX}{{1,4}} (":" {_HEX}{{1,4}}){{7}}'
_SEGMENT = "[a-zA-Z0-9._~-]{1,24}"
_SMALL = "[0-9]{1,2}"


def _uuid(version: str = _HEX, variant: str = _HEX) -> str:
    return (
        f'{_HEX}{{8}} "-" {_HEX}{{4}} "-" {version} {_HEX}{{3}} "-" {variant} {_HEX}{{3}}'
        f' "-" {_HEX}{{12}}'
    )


FORMATS: dict[str, tuple[str, int, int]] = {
    "date": (_DATE, 10, 10),
    "time": (_TIME, 9, 18),
    "date-time": (f'({_DATE}) "T" ({_TIME})', 20, 29),
    "uuid": (_uuid(), 36, 36),
    **{f"uuid{n}": (_uuid(f'"{n}"', "[89abAB]"), 36, 36) for n in range(1, 6)},
    "email": (f'{_ATOM} ("." {_ATOM}){{0,2}} "@" ({_DOMAIN})', 6, 96),
    "uri": (
        f'"http" "s"? "://" ({_DOMAIN}) (":" [1-9] [0-9]{{0,3}})? ("/" {_SEGMENT}){{0,8}} "/"?',
        11,
        259,
    ),
    "ipv4": (_IPV4, 7, 15),
    "ipv6": (_IPV6, 15, 39),
    "ipvanyaddress": (f"{_IPV4} | {_IPV6}", 7, 39),
    "duration": (
        f'"P" ({_SMALL} "D" ("T" {_SMALL} "H")? | "T" ({_SMALL} "H" ({_SMALL} "M")? '
        f'| {_SMALL} "M" ({_SMALL} "S")? | {_SMALL} "S"))',
        3,
        8,
    ),
}
