/* foreign_python.c - a host that looks like another CPython version to the preload
 * library (it exports Py_GetVersion, as a python executable does), then connects. */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

const char *Py_GetVersion(void) { return "3.99.0 (foreign)"; }

int main(int argc, char **argv)
{
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[1])), .sin_addr.s_addr = htonl(0x7f000001) };
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a)) { perror("connect"); return 1; }
    char buf[64] = "ping", got[64];        /* one 64-byte message: the pingpong server echoes it */
    size_t n = 0;
    if (write(s, buf, sizeof buf) != sizeof buf) { perror("write"); return 1; }
    while (n < sizeof got) {
        ssize_t r = read(s, got + n, sizeof got - n);
        if (r <= 0) { perror("read"); return 1; }
        n += (size_t)r;
    }
    printf("%s\n", got);
    return 0;
}
