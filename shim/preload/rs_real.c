/* rs_real.c - the libc functions the interposers stand in front of. */
#include "rs_preload.h"
#include <dlfcn.h>

struct rs_real rs_real;

#define R(name) rs_real.name = (__typeof__(rs_real.name))dlsym(RTLD_NEXT, #name)

/* Runs before main (and before any other constructor that might open a socket can
 * reach us through a hook: every hook also calls rs_real_init on its slow path). */
__attribute__((constructor)) void rs_real_init(void)
{
    if (rs_real.read) return;
    R(socket); R(connect); R(listen); R(accept); R(accept4); R(close); R(shutdown);
    R(dup); R(dup2); R(dup3); R(fcntl); R(ioctl); R(getsockopt); R(setsockopt);
    R(readv); R(writev); R(send); R(recv); R(sendto); R(recvfrom); R(sendmsg); R(recvmsg);
    R(sendfile); R(splice); R(sendmmsg); R(recvmmsg); R(preadv2); R(pwritev2); R(poll); R(ppoll); R(select); R(pselect); R(epoll_wait); R(epoll_pwait);
    R(epoll_pwait2);                  /* glibc 2.35+; NULL before */
    R(closefrom);                     /* glibc 2.34+; NULL before */
    R(epoll_ctl); R(write);
    R(execve); R(execveat); R(fexecve); R(execvpe);   /* execv, execvp, execl*: through these */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    R(read);                          /* last: it is the "initialised" flag */
}
