/* rs_contract.c - the reason table of rs_contract.h. */
#include <stddef.h>
#include "rs_contract.h"

#define RS_REASON_ROW(code, sym, name, text) [code] = { name, text },
static const struct { const char *name, *text; } reasons[] = { RS_REASONS(RS_REASON_ROW) };
#undef RS_REASON_ROW

const char *rs_reason_name(int code)
{
    return code > 0 && code < (int)(sizeof reasons / sizeof *reasons) ? reasons[code].name : NULL;
}

const char *rs_reason_text(int code)
{
    return code > 0 && code < (int)(sizeof reasons / sizeof *reasons) ? reasons[code].text : NULL;
}
