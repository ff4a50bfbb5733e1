/* rs_pyworld.c - which Python installation the engine belongs to, found at run time.
 *
 * Nothing about the build machine is baked in: the library finds itself (dladdr), and the
 * directory that holds the `rdmasock` package tells where it was installed:
 *
 *   <venv>/lib/python3.X/site-packages     a virtual environment: its bin/python3.X
 *   <prefix>/lib/python3.X/site-packages   an interpreter's own site: <prefix>/bin/python3.X
 *   anything else                          Debian's dist-packages, a --user install, a
 *                                          source checkout: the system's python3.X
 *
 * The engine starts its interpreter as that executable, so Python itself works out the
 * standard library, the venv and its site-packages (rdmasock/_world.py adds them).  The
 * executable's libpython is loaded before the engine, so no run path is needed either.
 */
#include "rs_preload.h"
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int is_file(const char *p) { return access(p, F_OK) == 0; }
static int is_exe(const char *p) { return access(p, X_OK) == 0; }

static void parent(char *path)
{
    char *s = strrchr(path, '/');
    if (s && s != path) *s = '\0';
    else if (s) s[1] = '\0';
}

/* The value of `key = value` in a pyvenv.cfg, or "" */
static void cfg_value(const char *cfg, const char *key, char *out, size_t outlen)
{
    out[0] = '\0';
    FILE *f = fopen(cfg, "re");
    if (!f) return;
    char line[PATH_MAX + 64];
    size_t klen = strlen(key);
    while (fgets(line, sizeof line, f)) {
        char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (strncmp(p, key, klen)) continue;
        p += klen;
        while (*p == ' ' || *p == '\t') p++;
        if (*p++ != '=') continue;
        while (*p == ' ' || *p == '\t') p++;
        size_t n = strcspn(p, "\r\n");
        while (n && (p[n - 1] == ' ' || p[n - 1] == '\t')) n--;
        snprintf(out, outlen, "%.*s", (int)n, p);
        break;
    }
    fclose(f);
}

/* First executable among dir/python3.X, dir/python3, dir/python. */
static int exe_in(const char *dir, char *out, size_t outlen)
{
    const char *names[] = { "python" RS_PY_VERSION, "python3", "python" };
    for (unsigned i = 0; i < sizeof names / sizeof *names; i++) {
        snprintf(out, outlen, "%s/%s", dir, names[i]);
        if (is_exe(out)) return 1;
    }
    return 0;
}

int rs_pyworld_find(struct rs_pyworld *w, char *why, size_t whylen)
{
    memset(w, 0, sizeof *w);
    Dl_info info;
    if (!dladdr((void *)rs_pyworld_find, &info) || !info.dli_fname || !realpath(info.dli_fname, w->pkgdir)) {
        snprintf(why, whylen, "engine_not_found: dladdr cannot name this library");
        return -1;
    }
    parent(w->pkgdir);                                  /* .../rdmasock */
    snprintf(w->root, sizeof w->root, "%s", w->pkgdir);
    parent(w->root);                                    /* where the package lives */

    /* A virtual environment holds the package a few levels below its pyvenv.cfg. */
    char dir[PATH_MAX], cfg[PATH_MAX + 16], bin[PATH_MAX + 8];
    snprintf(dir, sizeof dir, "%s", w->root);
    for (int up = 0; up < 4 && strcmp(dir, "/"); up++, parent(dir)) {
        snprintf(cfg, sizeof cfg, "%s/pyvenv.cfg", dir);
        if (!is_file(cfg)) continue;
        snprintf(bin, sizeof bin, "%s/bin", dir);
        if (exe_in(bin, w->exe, sizeof w->exe)) {
            cfg_value(cfg, "home", w->home, sizeof w->home);
            snprintf(w->kind, sizeof w->kind, "venv");
            break;
        }
    }
    /* <prefix>/lib/python3.X/site-packages of an interpreter (pyenv, /usr/local builds). */
    const char *tail = "/lib/python" RS_PY_VERSION "/site-packages";
    size_t rl = strlen(w->root), tl = strlen(tail);
    if (!w->exe[0] && rl > tl && !strcmp(w->root + rl - tl, tail)) {
        snprintf(bin, sizeof bin, "%.*s/bin", (int)(rl - tl), w->root);
        if (exe_in(bin, w->exe, sizeof w->exe)) snprintf(w->kind, sizeof w->kind, "prefix");
    }
    /* Debian's dist-packages, a --user install or a source checkout: the system Python. */
    if (!w->exe[0]) {
        const char *sys[] = { "/usr/bin", "/usr/local/bin" };
        for (unsigned i = 0; i < 2 && !w->exe[0]; i++)
            if (exe_in(sys[i], w->exe, sizeof w->exe)) snprintf(w->kind, sizeof w->kind, "system");
    }
    if (!w->exe[0]) {
        snprintf(why, whylen, "engine_not_found: no python%s interpreter for the package in %s", RS_PY_VERSION, w->root);
        return -1;
    }

    /* Its libpython: next to the real interpreter, next to the venv's home, or by soname. */
    char real[PATH_MAX];
    const char *soname = "libpython" RS_PY_VERSION ".so.1.0";
    w->libpython[0] = '\0';
    if (realpath(w->exe, real)) {
        parent(real);
        parent(real);
        snprintf(w->libpython, sizeof w->libpython, "%.4000s/lib/%s", real, soname);
        if (!is_file(w->libpython)) w->libpython[0] = '\0';
    }
    if (!w->libpython[0] && w->home[0]) {
        snprintf(dir, sizeof dir, "%s", w->home);
        parent(dir);
        snprintf(w->libpython, sizeof w->libpython, "%.4000s/lib/%s", dir, soname);
        if (!is_file(w->libpython)) w->libpython[0] = '\0';
    }
    if (!w->libpython[0]) snprintf(w->libpython, sizeof w->libpython, "%s", soname);
    return 0;
}
