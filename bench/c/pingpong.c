/* pingpong.c - 64-byte round trips over TCP with blocking read/write (the program the
 * LD_PRELOAD benchmark runs unmodified, with and without rdmasock).
 *   pingpong server PORT            serves one connection, echoing
 *   pingpong client PORT SECONDS    prints "round_trips_per_s N" */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "benchutil.h"

#define MSG 64

int main(int argc, char **argv)
{
    if (argc < 3) { fprintf(stderr, "usage: pingpong server|client PORT [SECONDS]\n"); return 2; }
    int port = atoi(argv[2]), one = 1;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(0x7f000001) };
    char buf[MSG];
    memset(buf, 'x', sizeof buf);
    if (!strcmp(argv[1], "server")) {
        int l = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (void *)&a, sizeof a) || listen(l, 1)) { perror("bind/listen"); return 1; }
        printf("ready\n");
        fflush(stdout);
        int c = accept(l, NULL, NULL);
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        while (rd_full(c, buf, MSG) == 0 && wr_full(c, buf, MSG) == 0) {}
        close(c);
        close(l);
        return 0;
    }
    double secs = argc > 3 ? atof(argv[3]) : 2.0;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a)) { perror("connect"); return 1; }
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int rc = timed_pingpong(s, buf, MSG, secs);
    close(s);
    return rc;
}
