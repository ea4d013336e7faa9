/* Stub of libnvinfer.so.11: only the C entry points that tensorrt.so (TensorRT 11.4 Python bindings) links
 * against, so the bindings import on a machine without TensorRT or a GPU and their names can be read.
 * Every factory returns NULL: nothing can be built or run with these, which is the point (static checks only). */
#include <stddef.h>
#include <stdint.h>

void *createInferBuilder_INTERNAL(void *logger, int32_t version) { (void)logger; (void)version; return NULL; }
void *createInferRefitter_INTERNAL(void *engine, void *logger, int32_t version) { (void)engine; (void)logger; (void)version; return NULL; }
void *createInferRuntime_INTERNAL(void *logger, int32_t version) { (void)logger; (void)version; return NULL; }
void *getBuilderPluginRegistry(int32_t capability) { (void)capability; return NULL; }
void *getPluginRegistry(void) { return NULL; }
void *getLogger(void) { return NULL; }
/* Not referenced by tensorrt.so 11.4, kept so a tool asking the library version gets 11.4.0. */
int32_t getInferLibVersion(void) { return 110400; }
