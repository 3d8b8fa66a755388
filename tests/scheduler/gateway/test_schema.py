"""The gateway's paths are documented in the OpenAPI schema beside the rest of the API."""


def test_the_schema_documents_the_gateway(client):
    paths = client.get("/api/schema/", {"format": "json"}).json()["paths"]
    assert paths["/api/jobs/{job_id}/wait/"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobOutput"
    }
    assert "text/event-stream" in paths["/api/jobs/{job_id}/stream/"]["get"]["responses"]["200"]["content"]
    assert {"/v1/chat/completions", "/v1/embeddings", "/v1/models"} <= set(paths)
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens"} <= set(paths)
    messages = paths["/v1/messages"]["post"]
    assert messages["responses"]["400"]["content"]["application/json"]["schema"]["properties"]["type"]["enum"] == [
        "error"
    ], "the Messages API's errors are in Anthropic's shape"
