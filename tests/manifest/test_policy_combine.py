"""Pure units and properties of combined trust policies (`TrustPolicy.combine`): the result
accepts a manifest exactly when both policies do, so a caller's policy put on top of the node's
can only tighten it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerstore import digest as digestmod
from manifest.errors import UntrustedManifest
from manifest.signing import PrivateKey, PublicKey, TrustPolicy, check_trust, combine_policies, sign_manifest

M = digestmod.of(b"manifest")
KEYS = [PrivateKey.generate() for _ in range(4)]
PUBS = [k.public_key() for k in KEYS]


def policy(*idx: int, require: bool = True) -> TrustPolicy:
    return TrustPolicy(require, frozenset(PUBS[i] for i in idx))


def signed(*idx: int) -> list:
    return [sign_manifest(M, KEYS[i]) for i in idx]


def passes(p: TrustPolicy, *idx: int) -> bool:
    try:
        check_trust(M, signed(*idx), p)
    except UntrustedManifest:
        return False
    return True


def test_a_permissive_caller_cannot_loosen_a_strict_node() -> None:
    node = policy(0)
    for caller in (TrustPolicy(False), policy(1), policy(1, 2, require=False)):
        eff = node.combine(caller)
        assert eff.require_signature
        assert not passes(eff)  # unsigned
        assert not passes(eff, 1)  # signed by the caller's key only
        assert passes(eff, 0) == passes(caller, 0)


def test_a_stricter_caller_is_honoured() -> None:
    eff = TrustPolicy(False).combine(policy(1))
    assert not passes(eff) and not passes(eff, 0) and passes(eff, 1)
    both = policy(0).combine(policy(1))  # each policy's key must have signed
    assert not passes(both, 0) and not passes(both, 1) and passes(both, 0, 1)
    with pytest.raises(UntrustedManifest, match="not signed by a key every trust policy in force trusts"):
        check_trust(M, signed(0), both)
    shared = policy(0, 2).combine(policy(1, 2))  # one signature by a key both trust is enough
    assert passes(shared, 2) and not passes(shared, 0) and passes(shared, 0, 1)


def test_normal_form() -> None:
    p = policy(0, 1)
    assert p.combine(p) == p and p.combine(None) == p
    assert combine_policies(None, None) is None and combine_policies(None, p) == p
    assert policy(0).combine(policy(0, 1)) == TrustPolicy(True, frozenset(PUBS[:2]), (frozenset(PUBS[:1]),))
    reported = TrustPolicy(False, frozenset(PUBS[:1]))
    assert reported.combine(TrustPolicy(False)) == reported
    j = policy(0).combine(policy(1)).to_json()
    assert j["require_signature"] and len(j["also_required"]) == 2


def test_strictness_order() -> None:
    assert policy(0).at_least_as_strict_as(TrustPolicy(False))
    assert not TrustPolicy(False).at_least_as_strict_as(policy(0))
    assert policy(0).at_least_as_strict_as(policy(0, 1))
    assert not policy(0, 1).at_least_as_strict_as(policy(0))
    assert policy(0).combine(policy(1)).at_least_as_strict_as(policy(1))
    assert policy(0).at_least_as_strict_as(None)


policies = st.builds(
    lambda req, keys: TrustPolicy(req, frozenset(PUBS[i] for i in keys)) if keys or not req else TrustPolicy(False),
    st.booleans(), st.sets(st.integers(0, len(PUBS) - 1)))
combined = st.lists(policies, min_size=1, max_size=3).map(lambda ps: combine_policies(*ps))
SIGNER_SETS = [s for n in range(len(PUBS) + 1) for s in itertools.combinations(range(len(PUBS)), n)]


def _accepts(p: TrustPolicy) -> set[tuple[int, ...]]:
    return {s for s in SIGNER_SETS if p.accepts(PUBS[i] for i in s)}


@settings(max_examples=200, derandomize=True, deadline=None)
@given(combined, combined, combined)
def test_combine_is_the_intersection(a: TrustPolicy, b: TrustPolicy, c: TrustPolicy) -> None:
    ab = a.combine(b)
    assert _accepts(ab) == _accepts(a) & _accepts(b)
    assert ab == b.combine(a) and ab.combine(c) == a.combine(b.combine(c)) and a.combine(a) == a
    assert ab.at_least_as_strict_as(a) and ab.at_least_as_strict_as(b)
    assert a.at_least_as_strict_as(b) == (_accepts(a) <= _accepts(b))
    assert ab.trusted_keys == a.trusted_keys | b.trusted_keys


@settings(max_examples=60, derandomize=True, deadline=None)
@given(combined, st.sampled_from(SIGNER_SETS))
def test_check_trust_agrees_with_accepts(p: TrustPolicy, signers: tuple[int, ...]) -> None:
    assert passes(p, *signers) == p.accepts(PublicKey(PUBS[i].raw) for i in signers)
