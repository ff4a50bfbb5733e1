/* A program whose signal handler calls exit() while its only thread is inside a send or
 * recv on an upgraded connection (tests/test_faults.py).  It connects to itself over
 * loopback, then moves 64 KiB blocks from one end to the other until a timer of argv[1]
 * microseconds fires; the handler calls exit(3).  The exit must not wait for a lock that
 * the interrupted call holds.  Prints "moving" once the first block went through. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

static void on_alarm(int sig)
{
    (void)sig;
    exit(3);
}

int main(int argc, char **argv)
{
    long us = argc > 1 ? atol(argv[1]) : 1000;
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof sa;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) || listen(l, 1) ||
        getsockname(l, (struct sockaddr *)&sa, &len))
        return 1;
    int a = socket(AF_INET, SOCK_STREAM, 0);
    if (a < 0 || connect(a, (struct sockaddr *)&sa, sizeof sa)) return 1;
    int b = accept(l, NULL, NULL);
    if (b < 0) return 1;
    static char out[65536], in[65536];
    memset(out, 'x', sizeof out);
    for (long round = 0;; round++) {
        for (size_t done = 0; done < sizeof out;) {
            ssize_t n = send(a, out + done, sizeof out - done, 0);
            if (n <= 0) return 1;
            done += (size_t)n;
        }
        for (size_t done = 0; done < sizeof in;) {
            ssize_t n = recv(b, in + done, sizeof in - done, 0);
            if (n <= 0) return 1;
            done += (size_t)n;
        }
        if (round == 0) {
            printf("moving\n");
            fflush(stdout);
            signal(SIGALRM, on_alarm);
            struct itimerval t = { .it_value = { us / 1000000, us % 1000000 } };
            setitimer(ITIMER_REAL, &t, NULL);
        }
    }
}
