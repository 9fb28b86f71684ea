"""Property-based API tests from the service's own OpenAPI document (schemathesis): whatever the
generated request (keys, ranges, conditional headers, bodies, query strings), the service answers
without a server error, and every refusal carries the error family's JSON."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerstore import keys
from layerstore.store import Store
from service.app import create_app
from service.auth import TokenTable


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> schemathesis.BaseSchema:
    root = tmp_path_factory.mktemp("openapi") / "store"
    with Store.open(str(root)) as s:
        s.init()
        chunk, _ = s.put_chunk(b"something to find" * 100)
        s.set_tag("team/app:v1", s.put_manifest(b"{}"))
        s.backend.replace("leases/l1/head", b"{}")
    KNOWN[:] = [keys.object_key("chunks", chunk), "config", "tags/team/app:v1", "leases/l1/head"]
    # no tokens file: every request is admin, so generated requests reach the backend
    app = create_app(Store.open(str(root)), TokenTable(None), body_timeout=5.0)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


KNOWN: list[str] = []  # keys that exist in the store (filled by the fixture)
OPERATIONS = [("/v1/objects/{key}", m) for m in ("GET", "HEAD", "PUT", "DELETE")] + [
    ("/v1/list", "GET"), ("/v1/delete", "POST"), ("/v1/batch", "POST"), ("/v1/store", "GET"), ("/v1/store", "POST"),
    ("/healthz", "GET"), ("/metrics", "GET"), ("/status", "GET")]


@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_no_request_makes_the_service_fail(api_schema: schemathesis.BaseSchema, path: str, method: str) -> None:
    strategy = api_schema[path][method].as_strategy()

    @given(case=strategy, known=st.sampled_from([None, *KNOWN]))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case: schemathesis.Case, known: str | None) -> None:
        if known is not None and case.path_parameters and "key" in case.path_parameters:
            case.path_parameters["key"] = known  # most random keys are refused early: reach the objects too
        if known is not None and case.path == "/v1/batch" and isinstance(case.body, dict):
            case.body = {**case.body, "keys": [known, *case.body.get("keys", [])[:3]]}
        response = case.call()
        assert response.status_code < 500, (case.method, case.path, case.path_parameters, response.text[:300])
        if response.status_code >= 400 and case.method != "HEAD":
            body = response.json()
            assert body["kind"] and body["error"] and isinstance(body["exit_code"], int), body

    check()


def test_the_document_describes_the_store_surface(api_schema: schemathesis.BaseSchema) -> None:
    doc = api_schema.raw_schema
    paths = doc["paths"]
    assert set(paths["/v1/objects/{key}"]) >= {"get", "head", "put", "delete"}
    assert {"/v1/list", "/v1/delete", "/v1/batch", "/v1/store", "/healthz", "/metrics"} <= set(paths)
    params = {p["name"] for p in paths["/v1/objects/{key}"]["get"]["parameters"]}
    assert {"range", "if-none-match"} <= params
    assert "HTTPBearer" in doc["components"]["securitySchemes"]
