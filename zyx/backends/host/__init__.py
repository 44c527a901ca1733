"""Host backend: C + OpenMP through the system compiler."""
