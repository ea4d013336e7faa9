/* Stub of libnvonnxparser.so.11 for importing the TensorRT 11.4 Python bindings without TensorRT (see nvinfer.c). */
#include <stddef.h>
#include <stdint.h>

void *createNvOnnxParser_INTERNAL(void *network, void *logger, int32_t version) { (void)network; (void)logger; (void)version; return NULL; }
void *createNvOnnxParserRefitter_INTERNAL(void *refitter, void *logger, int32_t version) { (void)refitter; (void)logger; (void)version; return NULL; }
int32_t getNvOnnxParserVersion(void) { return 110400; }
