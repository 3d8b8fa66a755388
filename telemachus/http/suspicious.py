"""Requests Django refuses as suspicious (`SuspiciousOperation`: a Host header not in
ALLOWED_HOSTS above all, also malformed multipart bodies, too many fields) are logged by Django on
`django.security.<Exception>` with the exception's traceback attached: some 40 lines per request
for something the client did, which a scanner sending random Host headers turns into a flood that
buries what matters. The settings route `django.security` through this filter: one line each,
Django's own message (`Invalid HTTP_HOST header: 'evil.example'. You may need to add ...`)."""

import logging


class WithoutTraceback(logging.Filter):
    """Lets every record through, without its exception's traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True
