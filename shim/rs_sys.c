/* rs_sys.c - the system calls the library makes for itself (rs_sys.h). */
#include "rs_sys.h"

/* The system call instruction itself: libc's syscall() is a symbol the preload library
 * interposes (libuv closes its descriptors with rs_syscall(SYS_close, fd)), and a call of
 * ours through that symbol would come back into the hook. */
static long trap(long n, long a, long b, long c, long d, long e, long f)
{
#if defined(__x86_64__)
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "0"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return r;
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
#else
    /* elsewhere through libc: the preload's hook then forwards what it does not handle */
    long r = syscall(n, a, b, c, d, e, f);
    return r < 0 ? -errno : r;
#endif
}

long rs_syscall6(long n, long a, long b, long c, long d, long e, long f)
{
    long r = trap(n, a, b, c, d, e, f);
    if (r < 0 && r > -4096) { errno = (int)-r; return -1; }
    return r;
}
