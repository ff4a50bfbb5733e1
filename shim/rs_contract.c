/* rs_contract.c - the reason and configuration tables of rs_contract.h. */
#include <stddef.h>
#include <stdlib.h>
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

#define RS_CONFIG_ROW(sym, name, dflt) [RS_CFG_##sym] = { name, dflt },
static const struct { const char *name, *dflt; } config[] = { RS_CONFIG(RS_CONFIG_ROW) };
#undef RS_CONFIG_ROW

int rs_config_count(void) { return RS_CONFIG_COUNT; }

const char *rs_config_name(int key)
{
    return key >= 0 && key < RS_CONFIG_COUNT ? config[key].name : NULL;
}

const char *rs_config_default(int key)
{
    return key >= 0 && key < RS_CONFIG_COUNT ? config[key].dflt : NULL;
}

const char *rs_config_get(int key)
{
    if (key < 0 || key >= RS_CONFIG_COUNT) return NULL;
    const char *v = getenv(config[key].name);
    return v && *v ? v : config[key].dflt;
}
