"""A trip booked as a saga: each booking registers its undo as it succeeds; if a later step
fails (or the run is cancelled with --compensate), the undos run, the last one first.

    marbles-rq --source examples/trip.py enqueue trip \
        --input '{"traveller": "ada", "card": "declined"}' --id trip-1
    marbles-rq status trip-1      # failed; compensation cancel_hotel done, cancel_flight done
"""

from __future__ import annotations

import msgspec

import marbles_rq as mr


class Trip(msgspec.Struct):
    traveller: str
    card: str = "ok"  # "declined": the payment fails, and the bookings are undone
    hold_s: float = 0.0  # wait this long for a "confirm" signal before paying


@mr.step(retries=3)
def cancel_flight(traveller: str, result: str) -> str:
    """The undo of book_flight: it receives the booking's arguments and its result."""
    return f"cancelled {result}"


@mr.step(compensate=cancel_flight)
def book_flight(traveller: str) -> str:
    return f"flight-{traveller}"


def cancel_hotel(booking: str) -> str:
    """A plain module-level function can be an undo too (registered with ctx.compensate)."""
    return f"cancelled {booking}"


@mr.step
def book_hotel(traveller: str) -> str:
    return f"hotel-{traveller}"


@mr.step
def charge_traveller(traveller: str, card: str) -> str:
    if card == "declined":
        raise ValueError(f"card of {traveller} declined")
    return f"paid-{traveller}"


@mr.workflow()
def trip(ctx: mr.RunContext, inp: Trip) -> dict[str, str]:
    flight = book_flight(inp.traveller)          # registers cancel_flight as it succeeds
    hotel = book_hotel(inp.traveller)
    ctx.compensate(cancel_hotel, hotel)          # registers an undo after any step
    if inp.hold_s:
        ctx.wait_for_signal("confirm", timeout_s=inp.hold_s)
    payment = charge_traveller(inp.traveller, inp.card)
    return {"flight": flight, "hotel": hotel, "payment": payment}
