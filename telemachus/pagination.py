from rest_framework.pagination import CursorPagination


class NewestFirstCursorPagination(CursorPagination):
    """Cursor pagination stays stable while new rows arrive, unlike page numbers or offsets."""

    ordering = "-id"
    page_size_query_param = "page_size"
    max_page_size = 500
